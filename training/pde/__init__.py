"""Operator experiments: Schrodinger eigenproblems solved with NeuralSVD (NestedLoRA), with
SpIN and NeuralEF as baselines and a finite-difference grid solver as a cross-check.

Modules: ``problems`` (registry, analytic solutions), ``quadrature`` (evaluation rules),
``laplacian`` (finite differences / autograd, the negative Hamiltonian), ``networks``
(batched disjoint MLPs), ``methods`` and ``baselines`` (update rules), ``config``
(settings, presets, flags), ``checkpoint`` (the checkpoint format: build, save, load,
resume check), ``train`` (loop, EMA), ``evaluate`` and ``metrics`` (the paper's measures),
``grid`` (classical solver), ``plots``, ``run`` (the pipeline the CLI in ``__main__``
calls).
"""
