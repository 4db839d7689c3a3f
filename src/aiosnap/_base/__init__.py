"""The ground floor: the error hierarchy, the one door to worker threads, the typed JSON
parser and the rules for names. Imports nothing of aiosnap's.

Nothing is imported here: the worker process starts from a bare package.
"""
