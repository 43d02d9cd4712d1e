"""HTTP/1.1 on the wire (sans-IO): request and response parsing, head encoding."""
