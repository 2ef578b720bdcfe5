"""Adapters: verify steps that run a real framework's own training code for one update.

Each module drives one framework (transformers' ``Trainer``, TRL's trainers, optax
``MultiSteps``, torchtitan, DeepSpeed, ...) and is a verify step in the protocol of
docs/verify.md: ``crosscheck verify --framework torch --step MODULE:STEP --model
MODULE:FACTORY --scheme SCHEME`` runs it alone, and ``crosscheck conformance`` runs every
setting of `crosscheck.conformance.settings`. A module imports its framework at the top: it is
imported only inside the ranks (and the reference process) of a verify run.

The rules every adapter keeps, so that a row is about the framework and not about the adapter:

* the framework's own code computes the loss, its normalization, the count and the backward;
  the adapter only builds the trainer around the model it is handed and the fixture's
  microbatches, and reads the gradient where the optimizer takes it;
* gradient clipping is off (clipping rescales the whole gradient and hides the weighting);
  every other deviation needed to run on CPU over gloo is stated in the setting's row;
* torch: ``step(model_factory, microbatches, optimizer)``: the framework wraps the model
  itself and steps the ``SGD(lr=1)`` it is given, so the harness reads the applied update;
* this rank's microbatches are the ones the framework's own data path feeds it (an adapter
  whose framework shards a global dataset checks that it did, and raises otherwise).
"""
