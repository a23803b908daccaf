"""ONNX Runtime without torch: evaluation of an exported model, and its measurement.

Imports numpy and onnxruntime only, never torch (nor anything of fleetfit that does),
so that the smallest devices can run it: a process importing onnxruntime but not torch
starts at about half the RSS. ``onnxrun.evaluate`` evaluates a classifier or a
language model on arrays; ``python -m onnxrun.evaluate`` is the measured child process
that ``onnxrun.measure`` starts.
"""
