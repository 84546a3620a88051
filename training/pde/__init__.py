"""Operator experiments: the lowest states of Schrodinger operators H = -k laplacian + V
learned with NeuralSVD (NestedLoRA), with SpIN and NeuralEF as baselines and a
finite-difference grid solver as a cross-check (docs/operators.md).

Modules: ``schrodinger`` (the Problem: operator, sampling, evaluation, presets; the API for
your own potential), ``problems`` (the registry), ``hydrogen`` and ``oscillator`` (the
built-in problems and their analytic solutions), ``quadrature`` (evaluation rules),
``laplacian`` (finite differences / autograd, the negative Hamiltonian), ``networks``
(batched disjoint MLPs), ``methods`` and ``baselines`` (update rules), ``arithmetic`` (the
stencil precision and update chosen by default), ``update`` (the fused RMSprop + EMA),
``config`` (settings, presets, flags), ``checkpoint`` (the checkpoint format), ``train``
(loop, EMA, time estimate), ``ritz`` (the Rayleigh-Ritz step), ``evaluate`` and
``metrics`` (the paper's measures), ``grid`` (classical solver), ``figures`` and ``plots``,
``run`` (the pipeline the CLI in ``__main__`` calls).
"""
