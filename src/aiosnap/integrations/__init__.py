"""Drop-in integrations with the training frameworks, each through its own extension point.

One module per framework, each importing its framework, so none is imported here:
``import aiosnap`` never imports a framework.

- ``aiosnap.integrations.ppe``: a pytorch-pfn-extras ``Writer`` and ``snapshot`` /
  ``snapshot_object`` extensions whose autoload reads aiosnap files
  (``pip install aiosnap[ppe]``).
- ``aiosnap.integrations.lightning``: ``AiosnapCheckpointIO`` for ``lightning``
  (``pytorch_lightning`` users: ``aiosnap.integrations.pytorch_lightning``;
  ``pip install aiosnap[lightning]``).
- ``aiosnap.integrations.transformers``: ``AiosnapTrainer`` and ``AiosnapTrainerMixin``
  for the Hugging Face Trainer (``pip install aiosnap[transformers]``).
- ``aiosnap.integrations.accelerate``: ``AiosnapAccelerator`` (``pip install
  aiosnap[accelerate]``).

Each is a blocking front over one aiosnap writer (``_bridge``): a framework's save call
returns once the state is captured, and the checkpoint is committed -- durable and atomic
-- in the background. Deleting an older checkpoint waits until the newer one is durable,
and deletes only what aiosnap recognises as its own (``_files``).
"""
