{{/* Names and labels. */}}
{{- define "kvmapper.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvmapper.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvmapper.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvmapper.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvmapper.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "kvmapper.selectorLabels" . }}
app.kubernetes.io/version: {{ include "kvmapper.tag" . | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kvmapper.tag" -}}
{{- default .Chart.AppVersion .Values.image.tag -}}
{{- end -}}

{{/* The image by digest when image.digest is set (the tag then only labels the objects). */}}
{{- define "kvmapper.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (include "kvmapper.tag" .) -}}
{{- end -}}
{{- end -}}

{{/*
kvmapper.bytes prints the bytes of a Kubernetes quantity of memory such as 512Mi, 1Gi or 500M
given as (dict "name" <its path> "value" <it>); it fails the render on a form it does not read.
*/}}
{{- define "kvmapper.bytes" -}}
{{- $q := toString .value -}}
{{- if not (regexMatch "^[0-9]+(\\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$" $q) -}}
{{- fail (printf "%s: %q is not a quantity of memory the chart reads for GOMEMLIMIT (write it as 512Mi or 1Gi, or set goMemLimitRatio: 0)" .name $q) -}}
{{- end -}}
{{- $n := float64 (regexFind "^[0-9.]+" $q) -}}
{{- $unit := trimPrefix (regexFind "^[0-9.]+" $q) $q -}}
{{- $scale := get (dict "" 1.0 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "k" 1000.0 "M" 1000000.0 "G" 1000000000.0 "T" 1000000000000.0 "P" 1000000000000000.0) $unit -}}
{{- printf "%d" (int64 (floor (mulf $n $scale))) -}}
{{- end -}}

{{/*
kvmapper.goMemLimit is the replicas' GOMEMLIMIT in bytes: goMemLimitRatio of
resources.limits.memory; empty without a memory limit, with a ratio of 0, or when extraEnv sets
GOMEMLIMIT itself.
*/}}
{{- define "kvmapper.goMemLimit" -}}
{{- $limit := dig "limits" "memory" "" (.Values.resources | default dict) -}}
{{- $ratio := float64 .Values.goMemLimitRatio -}}
{{- $own := false -}}
{{- range .Values.extraEnv }}{{ if eq .name "GOMEMLIMIT" }}{{ $own = true }}{{ end }}{{ end -}}
{{- if and $limit (gt $ratio 0.0) (not $own) -}}
{{- if gt $ratio 1.0 -}}
{{- fail (printf "goMemLimitRatio: %v is above 1: GOMEMLIMIT must be below the container's memory limit" .Values.goMemLimitRatio) -}}
{{- end -}}
{{- $bytes := include "kvmapper.bytes" (dict "name" "resources.limits.memory" "value" $limit) | float64 -}}
{{- printf "%d" (int64 (floor (mulf $bytes $ratio))) -}}
{{- end -}}
{{- end -}}

{{/*
kvmapper.scrapeTimeout is the ServiceMonitor's scrapeTimeout: metrics.serviceMonitor.scrapeTimeout,
which may not exceed the interval (the prometheus-operator rejects such a ServiceMonitor), or 10 s
and the interval when that is shorter.
*/}}
{{- define "kvmapper.scrapeTimeout" -}}
{{- $sm := .Values.metrics.serviceMonitor -}}
{{- $interval := include "kvmapper.millis" (dict "name" "metrics.serviceMonitor.interval" "value" $sm.interval) | int64 -}}
{{- if $sm.scrapeTimeout -}}
{{- $timeout := include "kvmapper.millis" (dict "name" "metrics.serviceMonitor.scrapeTimeout" "value" $sm.scrapeTimeout) | int64 -}}
{{- if gt $timeout $interval -}}
{{- fail (printf "metrics.serviceMonitor.scrapeTimeout: %s is longer than the interval %s, which Prometheus refuses" $sm.scrapeTimeout $sm.interval) -}}
{{- end -}}
{{- $sm.scrapeTimeout -}}
{{- else if lt $interval 10000 -}}
{{- $sm.interval -}}
{{- else -}}
10s
{{- end -}}
{{- end -}}

{{- define "kvmapper.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvmapper.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/*
kvmapper.value prints a flag's value: whole numbers without an exponent (Helm reads YAML
numbers as float64, which would print 67108864 as 6.7108864e+07).
*/}}
{{- define "kvmapper.value" -}}
{{- if and (kindIs "float64" .) (eq (floor .) .) -}}
{{- printf "%d" (int64 .) -}}
{{- else -}}
{{- printf "%v" . -}}
{{- end -}}
{{- end -}}

{{/*
kvmapper.millis prints the milliseconds (rounded up) of a Go duration such as 10s, 1m30s or
500ms given as (dict "name" <the value's path> "value" <it>); it fails the render on anything
else.
*/}}
{{- define "kvmapper.millis" -}}
{{- $d := toString .value -}}
{{- if not (regexMatch "^([0-9]+(\\.[0-9]+)?(h|m|s|ms|us|µs|ns))+$" $d) -}}
{{- fail (printf "%s: %q is not a duration the chart reads (write it as 10s, 1m30s or 500ms)" .name $d) -}}
{{- end -}}
{{- $total := 0.0 -}}
{{- range regexFindAll "[0-9.]+(h|ms|m|s|us|µs|ns)" $d -1 -}}
{{- $n := float64 (regexFind "^[0-9.]+" .) -}}
{{- $unit := trimPrefix (regexFind "^[0-9.]+" .) . -}}
{{- $scale := get (dict "h" 3600000.0 "m" 60000.0 "s" 1000.0 "ms" 1.0 "us" 0.001 "µs" 0.001 "ns" 0.000001) $unit -}}
{{- $total = addf $total (mulf $n $scale) -}}
{{- end -}}
{{- printf "%d" (int64 (ceil $total)) -}}
{{- end -}}


{{/*
kvmapper.setupKeys are the config keys `kvmapper setup` takes as well as `kvmapper run`: they go
to the setup Job too, so that setup creates what the replicas expect. The chart's tests check
this list against the binary's own --help.
*/}}
{{- define "kvmapper.setupKeys" -}}
mode layout partitions in out header unmapped incoming-stream outgoing-stream unmapped-stream groups-bucket control-bucket parked-stream parked-prefix direct-receive stream-replicas groups-history on-unmapped park-max-per-device park-max-total inbox-prefix connect-timeout reconnect-wait log-level log-format
{{- end -}}

{{/*
kvmapper.env prints one environment variable per set entry of the map given: kvmapper reads
every flag from KVMAPPER_ and its name in capitals (--drain-timeout: KVMAPPER_DRAIN_TIMEOUT).
Through the environment, rather than arguments, `kubectl exec … -- /kvmapper status` in a pod
runs with the same connection and names as the replica.
*/}}
{{- define "kvmapper.env" -}}
{{- range $k, $v := . }}
{{- $name := printf "KVMAPPER_%s" ($k | upper | replace "-" "_") }}
{{- if kindIs "slice" $v }}
{{- /* A repeatable flag: kvmapper splits its variable on commas. */ -}}
{{- range $v }}
{{- if contains "," (toString .) }}
{{- fail (printf "config.%s: %q holds a comma, which %s cannot carry (kvmapper splits it on commas)" $k (toString .) $name) }}
{{- end }}
{{- end }}
{{- if $v }}
- name: {{ $name }}
  value: {{ join "," $v | quote }}
{{- end }}
{{- else if and (not (kindIs "invalid" $v)) (ne (toString $v) "") }}
- name: {{ $name }}
  value: {{ include "kvmapper.value" $v | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* kvmapper.setupConfig is config restricted to kvmapper.setupKeys, plus setupJob.config. */}}
{{- define "kvmapper.setupConfig" -}}
{{- $out := dict -}}
{{- range $k := splitList " " (include "kvmapper.setupKeys" .) -}}
{{- if hasKey $.Values.config $k -}}
{{- $_ := set $out $k (get $.Values.config $k) -}}
{{- end -}}
{{- end -}}
{{- range $k, $v := .Values.setupJob.config -}}
{{- $_ := set $out $k $v -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/*
The connection to NATS, for a container: env, volumes and volume mounts. Each takes
(dict "root" $ "auth" <nats.auth or setupJob.auth>). Secrets are mounted read-only under
/etc/kvmapper/nats/<what>/; passwords and tokens come straight from their Secrets.
*/}}
{{- define "kvmapper.natsEnv" -}}
{{- $auth := .auth -}}
{{- $tls := .root.Values.nats.tls }}
- name: KVMAPPER_SERVER
  value: {{ join "," .root.Values.nats.urls | quote }}
{{- if $auth.context.secretName }}
- name: KVMAPPER_CONTEXT
  value: {{ printf "/etc/kvmapper/nats/context/%s" $auth.context.key | quote }}
{{- end }}
{{- if $auth.creds.secretName }}
- name: KVMAPPER_CREDS
  value: {{ printf "/etc/kvmapper/nats/creds/%s" $auth.creds.key | quote }}
{{- end }}
{{- if $auth.nkey.secretName }}
- name: KVMAPPER_NKEY
  value: {{ printf "/etc/kvmapper/nats/nkey/%s" $auth.nkey.key | quote }}
{{- end }}
{{- if $auth.user }}
- name: KVMAPPER_USER
  value: {{ $auth.user | quote }}
{{- end }}
{{- if $auth.passwordSecret.secretName }}
- name: KVMAPPER_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $auth.passwordSecret.secretName | quote }}
      key: {{ $auth.passwordSecret.key | quote }}
{{- end }}
{{- if $auth.tokenSecret.secretName }}
- name: KVMAPPER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ $auth.tokenSecret.secretName | quote }}
      key: {{ $auth.tokenSecret.key | quote }}
{{- end }}
{{- if $tls.secretName }}
{{- if $tls.ca }}
- name: KVMAPPER_TLSCA
  value: {{ printf "/etc/kvmapper/nats/tls/%s" $tls.ca | quote }}
{{- end }}
{{- if and $tls.cert $tls.key }}
- name: KVMAPPER_TLSCERT
  value: {{ printf "/etc/kvmapper/nats/tls/%s" $tls.cert | quote }}
- name: KVMAPPER_TLSKEY
  value: {{ printf "/etc/kvmapper/nats/tls/%s" $tls.key | quote }}
{{- end }}
{{- end }}
{{- if $tls.handshakeFirst }}
- name: KVMAPPER_TLS_FIRST
  value: "true"
{{- end }}
{{- end -}}

{{- define "kvmapper.natsVolumes" -}}
{{- $auth := .auth -}}
{{- $tls := .root.Values.nats.tls -}}
{{- range $what := list "context" "creds" "nkey" }}
{{- $s := get $auth $what }}
{{- if $s.secretName }}
- name: nats-{{ $what }}
  secret:
    secretName: {{ $s.secretName | quote }}
    items:
      - key: {{ $s.key | quote }}
        path: {{ $s.key | quote }}
{{- end }}
{{- end }}
{{- if $tls.secretName }}
- name: nats-tls
  secret:
    secretName: {{ $tls.secretName | quote }}
{{- end }}
{{- end -}}

{{- define "kvmapper.natsMounts" -}}
{{- $auth := .auth -}}
{{- $tls := .root.Values.nats.tls -}}
{{- range $what := list "context" "creds" "nkey" }}
{{- if (get $auth $what).secretName }}
- name: nats-{{ $what }}
  mountPath: /etc/kvmapper/nats/{{ $what }}
  readOnly: true
{{- end }}
{{- end }}
{{- if $tls.secretName }}
- name: nats-tls
  mountPath: /etc/kvmapper/nats/tls
  readOnly: true
{{- end }}
{{- end -}}

{{/*
kvmapper.stopSeconds is how long a replica may take, from SIGTERM, to hand its partitions over:
what the binary logs at start as stop_timeout_ms (mapper.Replica.StopTimeout), rounded up to
whole seconds. In stream mode each partition drains for up to drain-timeout (all at once) and
the replica allows 10 s beyond it for the final checkpoints and releases. In direct mode the
replica waits up to 30 s for each release (mapper.DirectReleaseTimeout), then for the handoffs
still under way (direct.Pool.CloseTimeout): handoff-timeout, three answer timeouts of 2 s and a
settle of 50 ms. deploy/check TestChartGracePeriodCoversTheStop compares the two.
*/}}
{{- define "kvmapper.stopSeconds" -}}
{{- if eq (toString (get .Values.config "mode")) "direct" -}}
{{- $handoff := include "kvmapper.millis" (dict "name" "config.handoff-timeout" "value" (default "5s" (get .Values.config "handoff-timeout"))) | int64 -}}
{{- add 30 (div (add $handoff 6050 999) 1000) -}}
{{- else -}}
{{- $drain := include "kvmapper.millis" (dict "name" "config.drain-timeout" "value" (default "10s" (get .Values.config "drain-timeout"))) | int64 -}}
{{- add 10 (div (add $drain 999) 1000) -}}
{{- end -}}
{{- end -}}

{{/*
kvmapper.gracePeriod is the pods' terminationGracePeriodSeconds: the preStop pause, the stop
(kvmapper.stopSeconds), and shutdown.marginSeconds for the lease deletes and the connection's
close after it.
*/}}
{{- define "kvmapper.gracePeriod" -}}
{{- add (int .Values.shutdown.preStopSeconds) (include "kvmapper.stopSeconds" . | int) (int .Values.shutdown.marginSeconds) -}}
{{- end -}}
