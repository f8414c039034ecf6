"""HTTP plumbing every layer of the API shares: OpenAI-shaped errors (`errors`) and JSON / streaming bodies (`bodies`)."""
