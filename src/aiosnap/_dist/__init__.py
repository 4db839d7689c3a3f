"""Groups: the channels members agree over (a group of one, or gloo), their messages,
and rank 0's decisions as pure functions.

Nothing is imported here: the worker process starts from a bare package.
"""
