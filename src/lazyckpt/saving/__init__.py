"""lazyckpt.saving."""
