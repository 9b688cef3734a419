"""How the model is split over the ranks: the layout (one device mesh), the strategies (ddp, fsdp, pipeline), tp."""
