"""neuron_compile: a torch.compile backend for AWS Trainium that generates NKI kernels.

Public API only. ``torch.compile(model, backend="neuron")`` works without importing this package (the
``torch_dynamo_backends`` entry point); import it for ``stats()`` / ``reset_stats()`` and ``config``.
"""

__version__ = "0.1.0"
