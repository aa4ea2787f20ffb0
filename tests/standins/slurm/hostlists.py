"""TEST CODE, not SLURM: the hostlist expression of SLURM's stand-ins (`srun`, `scontrol` in this folder), e.g.
``127.0.0.[1-2]`` or ``a,b[3,5-6]``, expanded the way `scontrol show hostnames` prints it."""

import re


def expand(hostlist: str) -> list[str]:
    hosts = []
    for part in re.findall(r"[^,\[]*(?:\[[^\]]*\][^,\[]*)*", hostlist):
        if not part:
            continue
        match = re.fullmatch(r"(.*?)\[([^\]]*)\](.*)", part)
        if not match:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            low, _, high = item.partition("-")
            for number in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{str(number).zfill(len(low))}{suffix}")
    return hosts
