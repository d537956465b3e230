"""neuron_compile.lowering."""
