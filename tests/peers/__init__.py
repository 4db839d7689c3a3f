"""Adapters that run a peer library's own tests with aiosnap standing in for its part."""
