"""One module per route: read the OpenAI request, call the pipeline (`mstar_core.api.requests`), shape the response.
No route imports another route; what two routes share lives in `requests/`."""
