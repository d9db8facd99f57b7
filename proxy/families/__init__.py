"""The task families beside chat: speech synthesis (tts), speech recognition (asr), image and
video generation. Schemas and translation are pure (`tts`, `asr`, `generation`); `handlers`
runs them on the request path (proxy.pipeline.task)."""
