"""The one exception type for bad input: the command line prints its message on one line and exits 2."""


def divisors(n: int) -> str:
    """'{1,2,3,6}': what divides n, as the one-line errors list the choices."""
    return "{" + ",".join(str(d) for d in range(1, n + 1) if n % d == 0) + "}"


class UserError(Exception):
    """Bad input from the user (a flag, a file, a layout). The message says what to change."""

    exit_code = 2


class SaveFailed(UserError):
    """A checkpoint save failed on some rank (a full disk, a quota); the previous one stands."""


class Diverged(UserError):
    """The run stopped itself: too many steps in a row with a non-finite loss or gradient (exit 3)."""

    exit_code = 3


class Stopped(Exception):
    """The run stopped on SIGTERM or SIGINT at a step boundary (outcome.stop), having said what
    it saved: the command exits 128 + the signal's number, printing nothing more."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by signal {signum}")
        self.exit_code = 128 + signum
