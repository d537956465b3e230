"""neuron_compile.runtime."""
