"""Offline work on model files: inspect, quantize (static int8 QDQ), convert to OpenVINO IR.

Submodules are imported directly (``from shared.modeltools.quantize import
quantize_static_qdq``) so that inspecting a file never pays for ONNX Runtime's
quantizer or OpenVINO's frontends, and the edge, which only runs models, never
imports any of this.
"""
