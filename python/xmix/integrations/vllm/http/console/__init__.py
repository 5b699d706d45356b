"""The xmix console: a page at ``/xmix/ui/`` on ``xmix serve`` (Playground, Apps, Live) and the
few JSON routes it needs besides the control plane. Plain HTML/CSS/JS under ``static/``,
shipped as package data: no build step, nothing loaded from outside the server."""

UI_PATH = "/xmix/ui/"


def console_url(args) -> str:
    """Where a person on this machine opens the console of a server started with ``args``
    (vLLM's serve arguments: host, port, ssl, root path)."""
    host = getattr(args, "host", None) or "localhost"
    if host in ("0.0.0.0", "::"):
        host = "localhost"
    if ":" in host:
        host = f"[{host}]"
    scheme = "https" if getattr(args, "ssl_certfile", None) else "http"
    root = (getattr(args, "root_path", None) or "").rstrip("/")
    return f"{scheme}://{host}:{getattr(args, 'port', 8000)}{root}{UI_PATH}"
