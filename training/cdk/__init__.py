"""Structured sketch/photo embeddings learned by NestedLoRA on the canonical dependence
kernel (paper section 4.2). Entry point: ``python -m training.cdk``; embedding API:
``training.cdk.model.embedder.Embedder``."""
