"""neuron_compile.passes."""
