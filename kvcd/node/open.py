"""Opens the configured node backend (kept apart from backend.py, which its implementations
import: the base class does not import them back)."""

from __future__ import annotations

import socket
from collections.abc import Mapping

from kvcd.config.model import Settings
from kvcd.host.paths import HostRoot
from kvcd.node.backend import Backend, node_name


def open_backend(root: HostRoot, settings: Settings, environ: Mapping[str, str]) -> Backend:
    """The configured backend. The kubernetes client is imported only when it is chosen."""
    name = node_name(settings, environ, socket.gethostname())
    if settings.node_backend == "kubernetes":
        from kvcd.node.kube import KubeBackend

        return KubeBackend(name, kubeconfig=settings.kubeconfig or None)
    from kvcd.node.filebackend import FileBackend

    return FileBackend(root, name)
