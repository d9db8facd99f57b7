"""Pure media helpers: identify audio, image and video bytes, measure them, write small files.

No I/O here (the layout test checks it): callers hand in bytes and get bytes or facts back.
"""
