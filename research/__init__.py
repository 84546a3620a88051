"""Experiments beside the product: studies of kernels, levers, fine-tuning and the
allocator that chose (or ruled out) the product's defaults. They use the public API of
``training`` and are not part of the installed package or the service image; each script
has a ``--smoke`` mode that the tests run."""
