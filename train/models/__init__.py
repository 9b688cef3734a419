"""The built-in models: vision (cnn, lenet, mlp, resnet18) and gpt."""

from train.moved import forward

__getattr__ = forward(__name__)  # the names of the module train/models.py was before train/ was grouped by concern
