"""The ``aiosnap`` command line.

Nothing is imported here: the worker process starts from a bare package.
"""
