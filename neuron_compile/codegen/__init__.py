"""neuron_compile.codegen."""
