"""What a built `out/` directory runs. Imports torch and triton only (never xdsl/jinja2/hypothesis)."""
