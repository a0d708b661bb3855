//! `TRUSTED_PROXIES`: which peers may tell us the client's address, and how to read it from
//! `X-Forwarded-For` (rightmost untrusted hop; leftmost when every hop is trusted) or `X-Real-IP`.
//! Pure: the reactor passes the peer address and the header values in.

use std::net::IpAddr;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, canonical(ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.prefix)).unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(self.prefix)).unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

/// IPv4-mapped IPv6 addresses (`::ffff:10.0.0.1`, as a dual-stack listener reports them) are
/// compared as the IPv4 address they carry.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustedProxies {
    nets: Vec<Cidr>,
}

impl TrustedProxies {
    /// `10.0.0.1, 192.168.0.0/16, ::1, fd00::/8`.
    pub fn parse(text: &str) -> Result<TrustedProxies, String> {
        let mut nets = Vec::new();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (ip_text, prefix_text) = match item.split_once('/') {
                Some((ip, prefix)) => (ip, Some(prefix)),
                None => (item, None),
            };
            let addr: IpAddr = ip_text.parse().map_err(|_| format!("{item:?} is not an IP address or CIDR"))?;
            let addr = canonical(addr);
            let max = if addr.is_ipv4() { 32 } else { 128 };
            let prefix = match prefix_text {
                None => max,
                Some(p) => match p.parse::<u8>() {
                    Ok(p) if p <= max => p,
                    _ => return Err(format!("{item:?} has a prefix length outside 0..={max}")),
                },
            };
            nets.push(Cidr { addr, prefix });
        }
        Ok(TrustedProxies { nets })
    }

    pub fn is_empty(&self) -> bool {
        self.nets.is_empty()
    }

    pub fn trusts(&self, ip: IpAddr) -> bool {
        self.nets.iter().any(|net| net.contains(ip))
    }

    /// The client address of a request that came from `peer` with these header values.
    pub fn client_ip(&self, peer: IpAddr, forwarded_for: Option<&str>, real_ip: Option<&str>) -> IpAddr {
        if !self.trusts(peer) {
            return canonical(peer);
        }
        if let Some(list) = forwarded_for {
            let mut leftmost = None;
            let mut parsed_all = true;
            for hop in list.rsplit(',').map(str::trim) {
                match parse_hop(hop) {
                    Some(ip) if self.trusts(ip) => leftmost = Some(ip),
                    Some(ip) => return ip,
                    None => {
                        parsed_all = false;
                        break;
                    }
                }
            }
            if parsed_all && let Some(ip) = leftmost {
                return ip;
            }
        }
        if let Some(ip) = real_ip.and_then(|v| parse_hop(v.trim())) {
            return ip;
        }
        canonical(peer)
    }
}

/// One hop: `1.2.3.4`, `1.2.3.4:5678`, `2001:db8::1` or `[2001:db8::1]:443`.
fn parse_hop(hop: &str) -> Option<IpAddr> {
    if let Ok(ip) = hop.parse::<IpAddr>() {
        return Some(canonical(ip));
    }
    if let Ok(sa) = hop.parse::<std::net::SocketAddr>() {
        return Some(canonical(sa.ip()));
    }
    let inner = hop.strip_prefix('[')?.strip_suffix(']')?;
    inner.parse::<IpAddr>().ok().map(canonical)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test ip")
    }

    fn check(trusted: &str, peer: &str, xff: Option<&str>, real: Option<&str>, expected: &str) {
        let proxies = TrustedProxies::parse(trusted).expect("parse");
        assert_eq!(proxies.client_ip(ip(peer), xff, real), ip(expected), "{trusted} {peer} {xff:?} {real:?}");
    }

    #[test]
    fn client_ip_table() {
        check("", "10.0.0.1", Some("1.2.3.4"), None, "10.0.0.1");
        check("10.0.0.1", "10.0.0.2", Some("1.2.3.4"), None, "10.0.0.2");
        check("10.0.0.1", "10.0.0.1", Some("1.2.3.4"), None, "1.2.3.4");
        check("10.0.0.0/8", "10.0.0.1", Some("6.6.6.6, 1.2.3.4, 10.1.1.1"), None, "1.2.3.4");
        check("10.0.0.0/8", "10.0.0.1", Some("10.9.9.9, 10.1.1.1"), None, "10.9.9.9");
        check("10.0.0.0/8", "10.0.0.1", None, Some("5.5.5.5"), "5.5.5.5");
        check("10.0.0.0/8", "10.0.0.1", Some("1.1.1.1"), Some("5.5.5.5"), "1.1.1.1");
        check("10.0.0.0/8", "10.0.0.1", Some("garbage"), Some("5.5.5.5"), "5.5.5.5");
        check("10.0.0.0/8", "10.0.0.1", Some("garbage"), None, "10.0.0.1");
        check("::1", "::1", Some("2001:db8::7"), None, "2001:db8::7");
        check("fd00::/8", "fd00::5", Some("[2001:db8::7]:443, fd00::9"), None, "2001:db8::7");
        check("127.0.0.1", "::ffff:127.0.0.1", Some("1.2.3.4:999"), None, "1.2.3.4");
        check("0.0.0.0/0", "9.9.9.9", Some("1.2.3.4"), None, "1.2.3.4");
    }

    #[test]
    fn parse_errors() {
        for bad in ["10.0.0.0/33", "::/129", "nope", "10.0.0.1/x"] {
            assert!(TrustedProxies::parse(bad).is_err(), "{bad}");
        }
        assert!(TrustedProxies::parse(" , ").expect("empty").is_empty());
    }
}
