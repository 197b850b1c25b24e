"""One client image's bytes -> a decoded RGB Pillow image, with the pixel limit checked first.

Pillow's ``Image.open`` reads only the header: the declared width and height are checked
against the limit (``--max-image-pixels``) before ``load()`` decompresses anything, so a small
file declaring a huge canvas (a decompression bomb) costs nothing. Pillow's own bomb guard
(``Image.MAX_IMAGE_PIXELS``, process-wide and left as it is) raises ``DecompressionBombError``
past twice its limit; that is refused the same way. Only the common web formats are opened
(``FORMATS``: Pillow's own decoders; never EPS, whose plugin runs Ghostscript). Anything else
is a ``ParameterError`` naming the part that carried it. Blocking work: callers run it on a
thread.
"""

from __future__ import annotations

import io
from typing import Any

from tokenwire.runtime.errors import ParameterError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")


def decode_image(data: bytes, part: str, max_pixels: int) -> Any:
    """The RGB image in ``data`` (the request field ``part``); ``ParameterError`` naming
    ``part`` when it is not a readable image or declares more than ``max_pixels`` pixels."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
        width, height = image.size
        if width * height > max_pixels:
            raise ParameterError(
                part,
                f"the image is {width}x{height} = {width * height} pixels, above the "
                f"server's limit of {max_pixels} (--max-image-pixels)",
            )
        image.load()
        return image.convert("RGB")
    except ParameterError:
        raise
    except Image.DecompressionBombError as exc:
        raise ParameterError(part, f"{exc} (--max-image-pixels)") from None
    except Exception as exc:  # any decoder failure on client bytes is a 400
        reason = str(exc) or type(exc).__name__
        raise ParameterError(part, f"not a decodable image: {reason}") from None
