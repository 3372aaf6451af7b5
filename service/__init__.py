"""rewa.service: the FastAPI service composing rewa.attention and rewa.index. Built by the issue
"The HTTP service"."""
