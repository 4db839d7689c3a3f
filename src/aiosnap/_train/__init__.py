"""Training-loop helpers: the Job and JobRunner, AsyncLoader and RNGState.

Nothing is imported here: the worker process starts from a bare package.
"""
