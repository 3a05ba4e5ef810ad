vcl 4.1;
# Varnish in front of bloomgate run with its filter and cache disabled: the
# second "REST service plus an HTTP cache" setup bench/run.sh compares
# against, configured like bench/nginx.conf.template so the two are
# comparable. run.sh fills in @UPSTREAM_HOST@ and @UPSTREAM_PORT@.
#
# - The cache key is the URL alone (nginx: proxy_cache_key $uri); no cookies,
#   no Authorization, nothing varies.
# - 200s are kept 60 s (the gateway's cache.ttl), 404s 5 s
#   (cache.negative_ttl); nothing else is cached. Grace is 0: nginx is not
#   told to serve stale entries (proxy_cache_use_stale is off), so neither is
#   Varnish. Concurrent misses for one URL wait for one fetch (Varnish's
#   waiting list, like nginx's proxy_cache_lock).
# - X-Cache-Status HIT/MISS, as nginx adds it.

backend gateway {
    .host = "@UPSTREAM_HOST@";
    .port = "@UPSTREAM_PORT@";
}

sub vcl_recv {
    if (req.method != "GET" && req.method != "HEAD") {
        return (pass);
    }
    unset req.http.Cookie;
    unset req.http.Authorization;
    return (hash);
}

sub vcl_hash {
    hash_data(req.url);
    return (lookup);
}

sub vcl_backend_response {
    unset beresp.http.Set-Cookie;
    set beresp.grace = 0s;
    if (beresp.status == 200) {
        set beresp.ttl = 60s;
    } elsif (beresp.status == 404) {
        set beresp.ttl = 5s;
    } else {
        # Not cached; remembered as uncacheable for a moment so that
        # concurrent requests are not serialised on the waiting list.
        set beresp.ttl = 1s;
        set beresp.uncacheable = true;
    }
    return (deliver);
}

sub vcl_deliver {
    if (obj.hits > 0) {
        set resp.http.X-Cache-Status = "HIT";
    } else {
        set resp.http.X-Cache-Status = "MISS";
    }
}
