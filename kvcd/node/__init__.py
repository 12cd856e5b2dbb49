"""Where node state is reported: a local file (default) or the Kubernetes Node object."""
