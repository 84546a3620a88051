"""What serving reads of a model: the model bundle format (``bundle``: the inference block,
the graphs, the weights, each file checked by its sha256), the backbones (one registry), the
two heads and the raw coordinates (``heads``), the PyTorch ``Embedder`` the bundle's weights
build, the encoder as an ONNX graph (``export``) and the gallery smoothing and query
expansion rules (``smoothing``).

Nothing here imports the training configuration or the training loop: the bundle's inference
block is all that index and service see of how a model was trained (``training.cdk.make_bundle``
writes it from a checkpoint, ``training.cdk.checkpoint``).
"""
