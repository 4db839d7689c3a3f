"""What a checkpoint is on storage: the header and its codec, dtypes, the captured
tree, shards of distributed tensors and their grid rules, the plan of a file image and a
group's manifest.

Nothing is imported here: the worker process starts from a bare package.
"""
