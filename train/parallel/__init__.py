"""How the model is split over the ranks: the layout (one device mesh), the strategies (ddp, fsdp, pipeline), tp."""

from train.moved import forward

__getattr__ = forward(__name__)  # the names of the module train/parallel.py was before train/ was grouped by concern
