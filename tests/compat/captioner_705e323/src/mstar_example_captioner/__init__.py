"""An M* model package written from the model author's guide: image encoder -> paged-KV caption decoder."""

__version__ = "0.1.0"
