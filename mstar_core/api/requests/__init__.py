"""The one pipeline for text and voice requests: an OpenAI request's messages and media become a model's request
fields (`pipeline`), with sampling checked, `n` choices run (`choices`), tools and response formats written into the
prompt and grammar (`tools`, `chat_tools`, `formats`), and the answer streamed or assembled (`text`, `logprobs`).
Chat, completions, responses, realtime and transcriptions all go through it. `adapters` is the model's side of it
(the `ApiAdapter` hooks), `submit` the engine's (admission, prepare, submit, disconnects)."""
