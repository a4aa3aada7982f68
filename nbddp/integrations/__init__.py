"""Framework integrations: what a framework logs goes to nbddp's panel.

Each submodule imports its framework, so import the one you use:

- ``nbddp.integrations.transformers.NbddpCallback``: a Hugging Face ``TrainerCallback``;
- ``nbddp.integrations.lightning.NbddpCallback``: a Lightning ``Callback``, added to
  every ``lightning.Trainer`` inside an nbddp run by itself (Lightning's
  ``callbacks_factory`` entry point); ``NbddpLogger`` for Lightning Fabric;
- ``nbddp.integrations.pytorch_lightning``: the same for the older ``pytorch_lightning``
  package (its own Trainer, Callback class and entry point);
- ``nbddp.integrations.accelerate.NbddpTracker``: for ``Accelerator(log_with=...)``.

Outside an nbddp run they do nothing (in an exported script run, ``nbddp.log`` prints).
"""
