"""The engines of an ipyparallel cluster someone else started: nothing to start, nothing to end."""

from __future__ import annotations

import logging
import os
from typing import Any

from ...errors import DDPUsageError, StartError, one_line
from .base import Provisioner

log = logging.getLogger("ddp_notebook")


class AttachedProvisioner(Provisioner):
    """Connects to a running cluster; `stop()` lets go of its engines and leaves them running."""

    clears_namespaces_on_restart = True

    def start(self) -> Any:
        import ipyparallel as ipp

        target = self.config.launch.attach
        assert target is not None
        connection_file = target.url_file
        if connection_file is None:
            # the profile's client connection file, as ipyparallel names it
            name = f"ipcontroller-{target.cluster_id}-client.json" if target.cluster_id else "ipcontroller-client.json"
            connection_file = os.path.join(profile_dir(target.profile), "security", name)
        if not os.path.isfile(connection_file):
            raise DDPUsageError(
                f"no cluster connection file at {connection_file}: is the cluster running? "
                "(give its ipcontroller-client.json, or the profile and cluster id ipcluster start was given)"
            )
        try:
            # the connection file goes positionally: ipyparallel 9 ignores url_file=
            self.client = ipp.Client(connection_file, timeout=min(10.0, self.config.start_timeout))
        except (OSError, TimeoutError, ValueError, KeyError) as failure:
            raise StartError(f"could not connect to the cluster at {target.describe()}: {one_line(failure)}") from None
        return self.client

    def expected_ranks(self) -> int:
        if self.config.n_ranks is not None:
            return self.config.n_ranks
        registered = len(self.client.ids)  # "every engine there": those registered by now
        if registered == 0:
            target = self.config.launch.attach
            raise StartError(
                f"the cluster at {target.describe() if target else '?'} has no engines yet: start some, or say how "
                "many to wait for (%ddp_attach -n N)"
            )
        return registered

    def engine_ids(self, wanted: int) -> list[int]:
        return sorted(self.client.ids)[:wanted]

    def too_few_message(self, registered: int, wanted: int) -> str:
        target = self.config.launch.attach
        return (
            f"only {registered} of {wanted} ranks registered within {self.config.start_timeout:g} s at "
            f"{target.describe() if target else '?'}; start more engines there, or attach with fewer"
        )

    def stop(self) -> None:
        # the engines belong to whoever started them: let go, leave them running
        client, self.client = self.client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                log.debug("closing the client failed", exc_info=True)


def profile_dir(profile: str | None) -> str:
    """An IPython profile's directory: a path as given, a name looked up in IPYTHONDIR."""
    if profile and os.path.isdir(profile):
        return os.path.abspath(profile)
    from IPython.paths import get_ipython_dir

    return os.path.join(get_ipython_dir(), f"profile_{profile or 'default'}")
