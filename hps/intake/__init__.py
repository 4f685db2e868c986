"""Arrays in: where keys and output buffers live, and the checks a lookup makes of them."""
