"""`InputError`: what every validator raises (arr_coc.validation for images, clips and questions,
arr_coc.video.decode for clips); its own module so that both can raise it without importing each other."""

from __future__ import annotations


class InputError(ValueError):
    """A problem with an input; the message is for the user as it is. `code` names the case."""

    def __init__(self, message: str, code: str = "invalid"):
        super().__init__(message)
        self.code = code


__all__ = ["InputError"]
