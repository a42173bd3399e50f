"""lazyckpt.state."""
