"""lazyckpt.loading."""
