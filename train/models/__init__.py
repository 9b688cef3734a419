"""The built-in models: vision (cnn, lenet, mlp, resnet18) and gpt."""
