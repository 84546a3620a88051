"""The sketch/photo embedding model: what training writes and the index and the service
read. Backbones (``backbones``), the two heads and the raw coordinates (``heads``), the
checkpoint format (``checkpoint``), the ``Embedder`` that rebuilds the model from a
checkpoint (``embedder``), the sketch encoder as an ONNX graph (``export``) and the gallery
smoothing rule the index applies to stored photos (``smoothing``).

Nothing here imports the training loop: ``training.cdk.train`` and ``run`` build on it.
"""
