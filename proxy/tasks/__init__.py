"""Async tasks (`async: true`): submitted on the request path after admission, queued in a Redis
Stream consumer group so any worker runs them (a dead worker's are reclaimed), polled at
`/v2/tasks/{id}` by their owner, their media fetched at `/v2/audio/media/{key}`."""
