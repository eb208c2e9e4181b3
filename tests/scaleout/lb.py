"""A TCP load balancer for the API replicas: `python -m tests.scaleout.lb --listen H:P --upstream H:P ...`.

Each accepted connection goes to the next upstream in round-robin order; an upstream that
refuses (or does not answer the connect within 1 s) is skipped for that connection, so a killed
replica costs clients only the connections that were open to it (Prefect's client retries
those). Bytes are piped unchanged both ways. It stands in for the load balancer (or Kubernetes
Service) in front of `prefect server start --no-services` replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass  # the other side went away: close ours below
    finally:
        writer.close()


async def serve(listen: tuple[str, int], upstreams: list[tuple[str, int]]) -> None:
    order = itertools.cycle(range(len(upstreams)))

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        start = next(order)
        for i in range(len(upstreams)):
            host, port = upstreams[(start + i) % len(upstreams)]
            try:
                up_r, up_w = await asyncio.wait_for(asyncio.open_connection(host, port), 1.0)
            except (OSError, TimeoutError):
                continue
            await asyncio.gather(_pipe(client_r, up_w), _pipe(up_r, client_w))
            return
        client_w.close()  # no upstream answered

    server = await asyncio.start_server(handle, *listen)
    async with server:
        await server.serve_forever()


def _addr(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--listen", type=_addr, required=True)
    parser.add_argument("--upstream", type=_addr, action="append", required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.listen, args.upstream))


if __name__ == "__main__":
    main()
