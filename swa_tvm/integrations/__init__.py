"""Integrations of swa_tvm's attention into other libraries, each behind its optional
dependency: :mod:`swa_tvm.integrations.transformers` (``pip install swa_tvm[transformers]``)."""
