"""Saving: the writers, the staging arena, the pipelined commit, the engines (a thread
or the worker process), device copies and the handles a save returns.

Nothing is imported here: the worker process starts from a bare package.
"""
