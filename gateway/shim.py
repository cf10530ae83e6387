"""Loopback TCP shim inside a harness's sandbox: ``127.0.0.1:PORT`` -> the rollout's gateway Unix socket.

Copied into the sandbox and run there as the sandbox's unprivileged user (``python3 shim.py PORT SOCKET``)
for harnesses that need a TCP URL; stdlib only. It forwards bytes both ways and nothing else: it can reach
only the socket its sandbox mounts. It exits when its parent (the harness launcher) is gone.
"""

import asyncio
import contextlib
import os
import sys


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError):
            writer.close()


async def main(port: int, socket: str) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(socket)
        except OSError:
            writer.close()  # the gateway is restarting: the client sees a reset and retries
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    parent = os.getppid()
    async with server:
        while os.getppid() == parent:
            await asyncio.sleep(1.0)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2]))
