"""uvicorn's httptools protocol with the request head counted as it arrives (`http_limits`).

httptools calls back a header only once its end arrived, so the count is kept on the
bytes fed to the parser: from the end of one request (or the connection's start) to the
end of the next one's head. A read that would pass the cap is fed only up to it; if the
head has not ended there, the request is refused. The parser never holds more than
`MAX_HEAD_BYTES` of a head, whatever size the reads come in. (Bytes of a pipelined
request's head that arrive in the same read as the previous request's end are not
counted: at most one read more.)
"""

from __future__ import annotations

import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from modelship.http_limits import MAX_HEAD_BYTES, head_too_large_response

logger = logging.getLogger(__name__)

LINGER_S = 1.0  # after a 431, how long what the client still sends is read and dropped


class HeadLimitedHttpToolsProtocol(HttpToolsProtocol):
    max_head_bytes = MAX_HEAD_BYTES

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._num_head_bytes: int | None = 0  # None while a request's body is read
        self._is_refused = False  # a head passed the cap: nothing more is parsed

    def data_received(self, data: bytes) -> None:
        if self._is_refused:
            return
        while data and self._num_head_bytes is not None:
            room = self.max_head_bytes - self._num_head_bytes
            if room <= 0:
                self._refuse_head()
                return
            piece, data = (data, b"") if len(data) <= room else (data[:room], data[room:])
            self._num_head_bytes += len(piece)
            super().data_received(piece)
            if self.transport.is_closing():  # the parser refused it (400), or hung up
                return
        if data:
            super().data_received(data)

    def on_headers_complete(self) -> None:
        self._num_head_bytes = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._num_head_bytes = 0

    def _refuse_head(self) -> None:
        logger.warning("request head over %d bytes refused (431)", self.max_head_bytes)
        self._is_refused = True
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined request's head while the previous response is being sent: let
            # that response finish, then close (a 431 now would cut into it).
            self.cycle.keep_alive = False
            self.flow.pause_reading()
            return
        self.transport.write(head_too_large_response(self.server_state.default_headers))
        # Closed at once, a socket with unread bytes sends a reset, which may reach a client
        # still sending its head before the 431 does; the rest is read and dropped a while.
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()
