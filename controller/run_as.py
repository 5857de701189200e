"""Running what is the user's own as the user who ran ``sudo gradbed ...``, never as root.

gradbed needs root for the network (namespaces, qdiscs, iptables rules); a ``gradbed
torchrun`` script's ranks are the user's own code, so they run as that user: ``setpriv``
with the user's uid, gid and login groups (``--init-groups``), and the variables a login
gives (``HOME``, ``USER``, ``LOGNAME``). One definition for the ranks of this machine's
hosts, for the warm process their torchrun agents fork from (``controller.warm``), and for
the ranks on other servers (``controller.torchrun.servers``, with that server's ids of the
same user name).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RunAs:
    """A user as one machine knows it: name, ids and home folder."""

    name: str
    uid: int
    gid: int
    home: str

    def argv(self, keep_caps: Sequence[str] = ()) -> list[str]:
        """The command prefix that runs what follows as this user (pure). ``keep_caps``:
        capabilities (setpriv's names: ``sys_admin``) that the command keeps, as ambient
        ones, across the change of user; none for anything that runs the user's code."""
        caps = ",".join(f"+{c}" for c in keep_caps)
        keep = [f"--inh-caps={caps}", f"--ambient-caps={caps}"] if caps else []
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups",
                *keep, "--"]

    def env(self) -> dict[str, str]:
        """The variables that name the user to what runs as them (pure)."""
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}


def invoking() -> RunAs | None:
    """The user who ran ``sudo gradbed ...`` as this machine knows them (``SUDO_UID``,
    ``SUDO_GID``); None when gradbed does not run as root through sudo."""
    import pwd

    from controller.rundir import invoking_user

    owner = invoking_user()
    if owner is None:
        return None
    uid, gid = owner
    user = pwd.getpwuid(uid)
    return RunAs(user.pw_name, uid, gid, user.pw_dir)
