"""The JSON client every server and reward service is reached through (grpo_accel/http.py), against a real socket
that does what a dying server does."""
import socket
import threading

import pytest

from grpo_accel.http import HTTPClient, ServerError

WHOLE = b'{"ok": true}'


def serve(answers: list[bytes]) -> str:
    """A listener on 127.0.0.1 that answers the i-th connection with ``answers[i]`` (headers and body as sent) and
    closes it; returns its URL."""
    listener = socket.create_server(("127.0.0.1", 0))

    def run():
        for answer in answers:
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)  # the request
                conn.sendall(answer)
                conn.shutdown(socket.SHUT_WR)  # then wait for the client to close: closing on unread bytes resets
                while conn.recv(65536):
                    pass
        listener.close()

    threading.Thread(target=run, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}"


def answer(body: bytes, length: int) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (length, body)


def test_an_answer_cut_short_is_retried_and_then_named_as_a_lost_connection():
    """A server killed while it sends its answer leaves the client an http.client.IncompleteRead, which is not an
    OSError: it used to escape as a raw traceback instead of being retried and named."""
    cut = answer(WHOLE[:5], len(WHOLE))  # promises 12 bytes, sends 5, closes
    assert HTTPClient(serve([cut, answer(WHOLE, len(WHOLE))]), retries=1, backoff_s=0.01).post("/x", {}) == {"ok": True}
    url = serve([cut, cut])
    with pytest.raises(ServerError, match=rf"^POST {url}/x: the server closed the connection before its answer was "
                                          r"whole \(IncompleteRead\(5 bytes read, 7 more expected\)\)$") as caught:
        HTTPClient(url, retries=1, backoff_s=0.01).post("/x", {})
    assert caught.value.status is None
